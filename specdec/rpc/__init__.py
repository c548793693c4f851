"""The contract and transport layer: generated gRPC code (v1), conversions between messages and the
core's types (convert; generation_convert for the generation messages, without torch), the status
mapping (status), a client's channel (channel) and what every server shares (grpc_support: options,
start-up, shutdown). Sits above the pure core and below the services and the orchestrator.
"""
