"""The shared engine: the runtime (backend, devices, meshes, compiled programs), sharding rules and meshes,
attention, weight loading, schedulers, LoRA, the values passed between stages, streamed VAE programs, and the base
class every model family builds on. It knows no family: families build on it."""
