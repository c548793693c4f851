"""Generated code of the wire contract `proto/specdec/v1/*.proto` (by proto/generate.py; do not edit)."""
