"""The digit task of the asynchronous RL loop (glm5_train/rl/digit_task.py)."""

from __future__ import annotations

import pytest

from glm5_train.rl.digit_task import EOD, DigitTask, demonstration_records


def test_prompts_read_as_text_and_answers_follow_the_kind():
    prompt = DigitTask("copy", 4).prompt_of([4, 0, 1, 7])
    assert DigitTask("copy", 4).text(prompt) == "C4017="
    assert DigitTask("copy", 4).text(DigitTask("copy", 4).answer(prompt)) == "4017<eod>"
    reverse = DigitTask("reverse", 4)
    assert reverse.text(reverse.answer(reverse.prompt_of([4, 0, 1, 7]))) == "7104<eod>"
    sums = DigitTask("sum", 4)  # running sums mod 10: 4, 4, 5, 12 -> 2
    assert sums.text(sums.answer(sums.prompt_of([4, 0, 1, 7]))) == "4452<eod>"


def test_the_reward_is_the_fraction_of_answer_digits_right():
    task = DigitTask("copy", 4)
    prompt = task.prompt_of([4, 0, 1, 7])
    digits = [ord(c) for c in "4017"]
    assert task.reward(prompt, digits + [EOD]) == 1.0 and task.exact(prompt, digits)
    assert task.reward(prompt, [ord(c) for c in "4917"]) == 0.75
    assert task.reward(prompt, [ord("4")]) == 0.25  # missing positions are wrong
    assert task.reward(prompt, digits + [ord("9")] * 5) == 1.0  # what follows is not judged
    assert not task.exact(prompt, [ord(c) for c in "401"])


def test_splits_are_reproducible_and_never_share_a_digit_string():
    task = DigitTask("copy", 4, seed=3)  # 10^4 strings: small enough to collide if unguarded
    assert [task.prompt(i) for i in range(5)] == [DigitTask("copy", 4, 3).prompt(i)
                                                  for i in range(5)]
    train = {tuple(task.digit_string(i, "train")) for i in range(3000)}
    heldout = {tuple(task.digit_string(i, "heldout")) for i in range(300)}
    assert not train & heldout and len(heldout) > 250
    assert task.prompt(0) != DigitTask("copy", 4, seed=4).prompt(0)


def test_demonstrations_are_solved_records():
    task = DigitTask("reverse", 6)
    records = demonstration_records(task, 3)
    for i, record in enumerate(records):
        assert list(record.prompt_ids) == task.prompt(i)
        assert list(record.response_ids) == task.answer(task.prompt(i))
        assert record.loss_mask.sum() == task.max_new_tokens


@pytest.mark.parametrize("kind, digits", [("add", 4), ("copy", 0), ("copy", 65)])
def test_bad_tasks_are_refused(kind, digits):
    with pytest.raises(ValueError):
        DigitTask(kind, digits)
