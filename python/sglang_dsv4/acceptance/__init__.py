"""Acceptance tools an operator runs against a deployment, installed with the distribution (so
the image carries them too): `sglang-dsv4 liveness`, `soak`, `throughput` and `release-gate`.
They talk to any OpenAI-compatible endpoint over HTTP and import nothing of upstream's serving
code, so they also run from a machine outside the cluster."""
