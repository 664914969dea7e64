"""What the applications (`fastbert.cli`, `fastbert.embedding`, `fastbert.training`, `fastbert.bench`) share, built
on the core and importing none of them: `resolve` (checkpoint, device and dtype from what a user named, and
`UserError`), `text` (sample sentences, the tokenizer wrapper, mean pooling) and `files` (the atomic writer)."""
