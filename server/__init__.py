"""server: `hybrid-serve`, an OpenAI-compatible HTTP front end. Handlers validate, enqueue into the engine and
stream back; one engine loop owns the model. Depends on `hybrid`, never the other way round."""
