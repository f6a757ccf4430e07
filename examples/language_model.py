"""A small language model trained on a text column, offline: a BPE tokenizer trained on the script's
own sentences, a 2-layer Llama built from its config (nothing downloaded), fit(task="causal-lm") on
two ranks, then transform(inference="generate") continues prompts and "score" rates sentences.

    python examples/language_model.py [--fast]
"""
import argparse
import os
import random
import sys

import torch

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def sentences(n, seed=0):
    rng = random.Random(seed)
    return [f"the {rng.choice(['big', 'small'])} {rng.choice(['cat', 'dog'])} {rng.choice(['sat', 'ran'])} "
            f"{rng.choice(['on', 'under'])} the {rng.choice(['red', 'blue'])} {rng.choice(['mat', 'tree'])} ."
            for _ in range(n)]


def tokenizer(texts):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=64, special_tokens=["<pad>", "</s>", "<unk>"]))
    return tok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fast", action="store_true", help="fewer sentences and epochs")
    args = parser.parse_args()
    from pyspark.sql import SparkSession
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparkring import SparkRingEstimator

    spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    texts = sentences(240 if args.fast else 2000)
    tok = tokenizer(texts)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=64))
    df = spark.createDataFrame([(t,) for t in texts], ["text"])
    lm = SparkRingEstimator(model=model, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), textCol="text",
                            tokenizer=tok, task="causal-lm", sequenceLength=32, batchSize=8,
                            epochs=3 if args.fast else 4, numProc=2, verbose=1).fit(df)
    last = lm.history[-1]
    print(f"perplexity {lm.history[0]['perplexity']:.1f} -> {last['perplexity']:.1f}, "
          f"{last['tokens_per_second_total']:,.0f} tokens/s on 2 ranks")
    prompts = spark.createDataFrame([("the big cat",), ("the small dog",)], ["text"])
    for row in lm.copy({lm.getParam("inference"): "generate"}).transform(prompts).collect():
        print(f"generate: {row.text!r} -> {row.prediction!r}")
    rated = spark.createDataFrame([("the big cat sat on the red mat .",), ("mat red the on sat cat big the",)],
                                  ["text"])
    for row in lm.copy({lm.getParam("inference"): "score"}).transform(rated).collect():
        print(f"score: {row.text!r} perplexity {row.prediction.perplexity:.1f}")
    spark.stop()


if __name__ == "__main__":
    main()
