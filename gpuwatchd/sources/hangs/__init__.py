"""Hang inputs and forensics: job views from /proc, NCCL RAS queries, py-spy stacks."""
