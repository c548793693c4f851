"""The contract and transport layer: generated gRPC code (v1), conversions between messages and the
core's types (convert), and what every server and client shares (grpc_support: options, status
mapping, start-up, shutdown). Sits above the pure core and below the services and the orchestrator.
"""
