"""The KV page pool on the host: the page allocator with its prefix cache (`pages`) and the pool's size (`sizing`)."""
