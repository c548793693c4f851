"""The GPU device check: one command (bench/device/run.sh) that checks exactness on CUDA and times
the product's paths at real model sizes within a few minutes of a lent GPU (docs/gpu.md)."""
