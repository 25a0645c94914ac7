"""diffslot engine: one process owns the accelerator and denoises every admitted
request as its own trajectory in a shared batch of slots."""
