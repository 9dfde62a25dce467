"""The shipped preference set is what its generator makes from the shipped chat set, and each
pair is a near miss: the rejected reply differs from the chosen one in its answer word only, a
word the shipped tokenizer knows."""
from megatrain_nb.assets import chat_tokenizer, conversations, preference_dataset, preference_rows
from megatrain_nb.assets.preferences import generate_preferences
from megatrain_nb.trainer.dpo_data import builtin_preference_pairs


def test_the_shipped_file_is_the_generated_set():
    rows = preference_rows()
    assert rows == generate_preferences(conversations())
    assert len(rows) == 240 and builtin_preference_pairs(5) == rows[:5]
    assert preference_dataset(3).column_names == ["prompt", "chosen", "rejected"]


def test_each_rejected_reply_is_a_near_miss_in_the_vocabulary():
    tok = chat_tokenizer()
    for i, (row, conv) in enumerate(zip(preference_rows(), conversations())):
        assert row["prompt"] + row["chosen"] == conv["messages"], i
        chosen, rejected = row["chosen"][0]["content"].split(), row["rejected"][0]["content"].split()
        assert len(chosen) == len(rejected), i
        assert sum(a != b for a, b in zip(chosen, rejected)) == 1, i
        assert tok.unk_token_id not in tok(" ".join(rejected))["input_ids"], i
