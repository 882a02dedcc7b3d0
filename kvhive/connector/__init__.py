"""KV connector: a scheduler half (torch-free) and a worker half (torch) that move KV blocks between
the device pool and the store tiers. ``base`` holds the interfaces and the plain data they exchange;
``offload`` the scheduler half over a TieredStore; ``offload_worker`` its worker half."""
