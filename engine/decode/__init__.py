"""The decode stage: final latents in, finished outputs out.

`stage` declares the interface the engine process drives and the post-processing;
`in_process` decodes on a thread; `workers` + `arena` decode in worker processes fed
through shared memory; `factory.make_decode_stage` picks one for `--decode-workers N`.
"""
