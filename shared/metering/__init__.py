"""Usage metering and billing: usage records, the per-tenant counters they add to, and their price."""
