"""API adapters: one module per wire API over the serving runtime."""
