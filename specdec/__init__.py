"""specdec: exact speculative decoding for Hugging Face causal LMs.

This package holds the pure core (sampling, races, trees, verification, the method registry,
theory and analysis, the model runtime and the engines) and, in subpackages above it, the
contract and transport (specdec.rpc) and the command line (specdec.cli). The core never imports
grpc, redis or OpenTelemetry (tests/test_architecture.py checks the layering with import-linter).
Importing this package itself imports nothing: `import specdec.methods` stays light.
"""
