"""The model worker: model loading and support checks, the KV tensors, a step's inputs, the forward
(compiled, CUDA graphs), warm-up and the model runner that ties them together."""
