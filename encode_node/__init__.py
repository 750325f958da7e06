"""An encode node: the vision encoder alone, pushing each image's output into a prefill node's
encoder cache over the typed transfer (docs/images.md, "The encode pool")."""
