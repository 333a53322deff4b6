"""epd.kvtransfer.v1 (generated modules: kvtransfer_pb2, kvtransfer_pb2_grpc)."""
