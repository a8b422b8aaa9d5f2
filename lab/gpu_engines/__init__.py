"""klppo on one GPU under each engine accelerate launches (`results/gpu_engines/`)."""
