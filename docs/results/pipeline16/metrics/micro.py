import sys
import timeit

from starlette.requests import Request

from gateway import openai_routes as r
from gateway import openai_schema as s
from gateway.backend import ModelState
from gateway.generation import Delta
from proto import scheduler_pb2

m = ModelState(info=scheduler_pb2.ModelInfo(), tokenizer=None, served_name="SmolLM2-135M-Instruct", max_model_len=2048, vocab_size=1)
fmt = r._CompletionFormat(Request({"type": "http", "state": {"request_id": "req-abc"}}), m, s.CompletionRequest(model="m", prompt="hi"), [1], "hi")
d = Delta(" world", [1], None, 0)
n = 20000
t = timeit.timeit(lambda: r._event(fmt.chunks(d, None, False)[0]), number=n)
print(f"{sys.argv[1]}: {t / n * 1e6:.2f} us per completion chunk")
