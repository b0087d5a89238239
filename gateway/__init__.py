"""The FastAPI gateway through which agents reach the inference engine and trajbus."""
