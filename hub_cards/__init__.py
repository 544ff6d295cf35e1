"""Model card templates published by `osprey push` (Jinja, rendered by `huggingface_hub.ModelCard.from_template`)."""
