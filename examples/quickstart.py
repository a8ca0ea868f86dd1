"""Train a peft LoRA model with the exact iEF optimiser, then compare gamma of three directions (runs in seconds)."""
import torch
import peft
import ief
from transformers import T5Config, T5ForConditionalGeneration

torch.manual_seed(0)
config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                  decoder_start_token_id=0, pad_token_id=0)
model = peft.get_peft_model(T5ForConditionalGeneration(config),
                            peft.LoraConfig(r=8, target_modules=["q", "v"], lora_dropout=0.1))

# A toy task: copy the first two input tokens. Labels may be padded with -100 (ignored positions).
input_ids = torch.randint(2, 64, (32, 10))
attention_mask = torch.ones_like(input_ids)
attention_mask[::4, 7:] = 0                                   # some padded inputs
labels = input_ids[:, :2].clone()
inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
              decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels=labels))

opt = ief.optim.IEF(model, lr=1.0, damping=1e-7)               # the exact iEF update (alg:iEF)
model.train()
for step in range(30):
    loss = opt.step(inputs, labels)                           # forward + per-sample backward + update
    if step % 10 == 0:
        print(f"step {step:2d}  L = {loss.item():.3f}")

# The paper's indicator gamma (smaller = closer to the natural gradient), for three directions:
model.eval()
ps = ief.per_sample(model, inputs, labels)
for name, d in {"SGD": ps.gradient,
                "EF": ief.ef_direction(ps.jacobian, 1e-7),
                "iEF": ief.ief_direction(ps.jacobian, ps.logit_sqnorm, 1e-7)}.items():
    print(f"gamma({name}) = {ief.gamma(model, inputs, labels, d):.4g}")
