"""Generated protobuf/gRPC code for epd's wire (sources: proto/epd/**/*.proto; run `make setup` to generate)."""
