"""What runs (torch-free): the scheduler, its slot maps and ledger, the request state
machine, and the plans and outcomes it exchanges with the runner. Nothing here imports
torch, so the scheduler is driven in tests with plain requests and no model."""
