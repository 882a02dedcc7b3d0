"""What every layer shares and nothing in it imports torch: block hashing, tokenizer and chat
template, request-body parsing, API-key tenancy and the model-file lookup."""
