"""A stand-in for the `tensorflow_model_server` binary (which cannot be installed here): real
TensorFlow serving SavedModels over TF-Serving's own gRPC protos and its REST API, for the tests
and the demo."""
