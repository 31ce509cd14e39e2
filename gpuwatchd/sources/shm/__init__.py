"""/dev/shm: capacity and NCCL segments with their holders, and the opt-in clean-up."""
