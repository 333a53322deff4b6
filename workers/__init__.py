"""epd workers: the torch engine (runtime/) and one gRPC worker per stage (encode/, prefill/, decode/)."""
