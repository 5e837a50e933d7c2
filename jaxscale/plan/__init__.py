"""Planning for GPUs that are not here: the target table, deviceless compiles and their memory plans."""
