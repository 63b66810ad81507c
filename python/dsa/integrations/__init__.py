"""Integrations of dsa's ops into model libraries. Each lives in its own subpackage and
imports its library only when it is imported itself, so ``import dsa`` stays free of them."""
