"""A step's batch: its leaves checked, one PartitionSpec each, and placed on the mesh."""
