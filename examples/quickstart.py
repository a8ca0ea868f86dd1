"""The exact iEF optimiser in your own training loop (a tiny T5 with peft LoRA), then gamma of two directions."""
import warnings
import torch
import peft
import ief
from transformers import T5Config, T5ForConditionalGeneration

warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # raised inside peft
torch.manual_seed(0)
config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                  decoder_start_token_id=0, pad_token_id=0)
model = peft.get_peft_model(T5ForConditionalGeneration(config), peft.LoraConfig(r=8, target_modules=["q", "v"]))
input_ids = torch.randint(2, 64, (32, 10))                 # a toy task: copy the first two tokens
labels = input_ids[:, :2].clone()                           # class indices; -100 marks ignored positions
inputs = dict(input_ids=input_ids, decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels=labels))
opt = ief.optim.IEF(model, lr=1.0, damping=1e-7)            # the exact iEF update (the paper's Algorithm 1)
for step in range(30):                                      # your loop: no backward(), no zero_grad()
    loss = opt.step(inputs, labels)                         # forward + per-sample backward + update
    if step % 10 == 0:
        print(f"step {step:2d}  L = {loss.item():.3f} (summed over 64 tokens; {loss.item() / 64:.3f} per token)")
ps = ief.per_sample(model.eval(), inputs, labels)           # gamma: smaller = closer to the natural gradient
for name, d in {"SGD": ps.gradient, "iEF": ief.ief_direction(ps.jacobian, ps.logit_sqnorm, 1e-7)}.items():
    print(f"gamma({name}) = {ief.gamma(model, inputs, labels, d):.4g}")
