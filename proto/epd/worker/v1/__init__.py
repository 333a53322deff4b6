"""epd.worker.v1 (generated modules: worker_pb2, worker_pb2_grpc)."""
