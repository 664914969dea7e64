"""fastbert's Triton kernels (installed as `fastbert.kernels`): the `triton` backend of `fastbert.ops`.

Importing this package registers the triton implementations with `fastbert.backends`.
"""
