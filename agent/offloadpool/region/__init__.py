"""Node-side region engine: plan, provision, populate, keep and release pool memory (stdlib only)."""
