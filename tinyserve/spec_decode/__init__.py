"""Speculative decoding: n-gram prompt lookup proposals, verified by the target model in one
forward (docs/architecture.md, "Speculative decoding")."""
