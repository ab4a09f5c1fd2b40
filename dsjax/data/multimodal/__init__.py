"""Images and videos beside the tokens: decoding (`media`), VL2's tiling (`tiling`), placeholder
expansion (`layout`), the on-disk splits (`shards`), prepare from JSONL (`prepare`), packing rows
with their views (`pack`), and cpu_vl's packaged corpus (`vl_corpus`, `vl_sources`).

Importing this package costs nothing: each module is imported where it is used.
"""
