"""Turn a Hugging Face checkpoint or a GGUF file into an Orbit package."""
