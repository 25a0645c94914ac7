"""diffslot: a serving engine for diffusion image generation."""
from setuptools import Extension, find_packages, setup

setup(
    name="diffslot",
    version="0.1.0",
    description="Serving engine for diffusion image generation: per-request trajectories in a shared batch of slots",
    python_requires=">=3.11",
    packages=find_packages(include=["engine", "engine.*", "frontend", "frontend.*"]),
    package_data={"engine.models": ["shapes/weights/*.json", "shapes/weights/*/*", "shapes/controlnet/*"],
                  "engine.instrument": ["page.html"]},
    ext_modules=[
        Extension(
            "engine._C",
            sources=["csrc/atomics.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall"],
        )
    ],
    install_requires=[
        # 2.13.0 exactly: on a CPU machine pip takes the CPU build lying on disk rather
        # than downloading a multi-GB CUDA build of a newer release.
        "torch==2.13.0",
        "diffusers>=0.35",
        "transformers>=4.45",  # the pipelines' text encoders and tokenizers
        "triton>=3.0",
        "pyzmq>=26",
        "msgspec>=0.19",
        "safetensors",
        "peft>=0.17",  # LoRA adapters (`--lora-dir`): diffusers' loaders build peft configs
        "pillow",
        "numpy",
        "prometheus-client",
        "tqdm",
        "fastapi",  # the OpenAI-compatible HTTP gateway (frontend.http)
        "uvicorn",
    ],
    extras_require={
        "ray": ["ray[serve]>=2.60"],  # frontend.ray_app: scale-out on Ray Serve
        "s3": ["boto3"],  # the gateway's output store on S3-compatible object storage (--output-store s3://...)
        "dev": ["pytest", "pytest-timeout", "pytest-benchmark", "hypothesis", "matplotlib", "selenium>=4.11",
                "openai>=1.80", "httpx", "ray[serve]>=2.60", "boto3", "moto[server]>=5"],
    },
    entry_points={"console_scripts": ["diffslot=engine.__main__:main"]},
)
