"""Worker programs the distributed tests launch in separate processes, and their launcher."""
