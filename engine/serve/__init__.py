"""The engine process around the core: `proc` (EngineCoreProc: sockets, IO thread, busy
loop, signals), `transport` (addresses, ipc sockets, the waker), `metrics` (Prometheus),
`launcher` (starting and stopping an engine process)."""
