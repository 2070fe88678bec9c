"""The benchmark scripts (`benchmarks/NAME.py`) and their one entry point, `python -m benchmarks` (see
`__main__.py` and benchmarks/README.md). Each script also still runs as `python benchmarks/NAME.py`."""
