"""diffslot: a serving engine for diffusion image generation."""
from setuptools import Extension, find_packages, setup

HTTP = ["fastapi", "uvicorn"]
# the test runner; triton so that the kernels' tests run them through its interpreter on CPU
TEST = ["pytest", "pytest-timeout", "pytest-benchmark", "hypothesis", "triton>=3.0"]
# the clients and services the HTTP, Ray, S3, plot and browser tests drive
TEST_CLIENTS = ["openai>=1.80", "httpx", "boto3", "moto[server]>=5", "matplotlib", "selenium>=4.11"]

setup(
    name="diffslot",
    version="0.1.0",
    description="Serving engine for diffusion image generation: per-request trajectories in a shared batch of slots",
    python_requires=">=3.11",
    packages=find_packages(include=["engine", "engine.*", "frontend", "frontend.*"]),
    package_data={"engine.models": ["shapes/weights/*.json", "shapes/weights/*/*", "shapes/loras/*/*.safetensors",
                                    "shapes/controlnet/*", "shapes/dit_weights/*.json", "shapes/dit_weights/*.md",
                                    "shapes/dit_weights/*/*"],
                  "engine.instrument": ["page.html"]},
    ext_modules=[
        Extension(
            "engine._C",
            sources=["csrc/atomics.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall"],
        )
    ],
    install_requires=[
        # The engine runs on this release. Which build pip takes (CPU or CUDA) is the index's
        # choice, not the pin's: PyPI's Linux wheel is the CUDA build, whose own dependencies
        # bring triton; the CPU build comes from PyTorch's CPU index (see the README).
        "torch==2.13.0",
        "diffusers>=0.35",
        "transformers>=4.45",  # the pipelines' text encoders and tokenizers
        "huggingface_hub",  # hub ids in --model: the local cache, or a download
        "pyzmq>=26",
        "msgspec>=0.19",
        "safetensors",
        "peft>=0.17",  # LoRA adapters (`--lora-dir`): diffusers' loaders build peft configs
        "pillow",
        "numpy",
        "prometheus-client",
        "tqdm",
    ],
    extras_require={
        # the GPU kernels; CUDA builds of torch on Linux already depend on it, and the CPU path never needs it
        "cuda": ["triton>=3.0"],
        "http": HTTP,  # python -m frontend http: the OpenAI-compatible gateway
        "s3": ["boto3"],  # the gateway's output store on S3-compatible object storage (--output-store s3://...)
        "ray": ["ray[serve]>=2.60", *HTTP],  # frontend.ray_app: the gateway on Ray Serve replicas
        "plot": ["matplotlib"],  # PNG plots of the queue instrument and the benchmarks
        "browser": ["selenium>=4.11"],  # the queue instrument's browser test (with Debian's chromium-driver)
        "test": TEST,
        # what the whole test suite needs (its HTTP, Ray, S3, plot and browser tests too)
        "dev": [*TEST, *HTTP, *TEST_CLIENTS, "ray[serve]>=2.60"],
    },
    entry_points={"console_scripts": ["diffslot=engine.__main__:main"]},
)
