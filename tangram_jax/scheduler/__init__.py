"""Host-side page pool, block tables, KV-cache manager and scheduler (plain numpy)."""
