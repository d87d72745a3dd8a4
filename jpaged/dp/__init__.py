"""Data-parallel serving: engine replicas as Ray actors behind one KV-cache-aware router."""
