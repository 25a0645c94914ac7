"""The parts of `bench/gpu_check.py`, one module per part, each with `run(args)`.

Shared by the parts: `report` (the table of rows every check writes to),
`engine_internals` (the only module here that imports `engine.core`),
`kernel_cases` (update-kernel inputs and the bitwise comparison), `stream_hold`
(holding the CUDA stream with `torch.cuda._sleep`), `sd15` (the SD-1.5-architecture
UNet and VAE), `text_stand_in` (random prompt rows in place of text encoders),
`engine_runs` (an EngineCore stepped to the end against the denoiser's peak) and
`served` (the engine's busy loop with a decode stage, in-process).

Nothing here imports torch at package import: `gpu_check.py` puts the carried wheels on
`sys.path` (`carried_wheels`) before any part module is imported.
"""
