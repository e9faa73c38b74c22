"""Respacing keeps exactly the timesteps improved-diffusion keeps.

improved-diffusion's rule (respace.py there): a section of `size` steps keeping `count` advances a
float cursor from 0.0 by repeated addition of frac_stride = (size - 1) / (count - 1) and keeps
round(cursor), Python's round (ties to even). "ddimN" keeps range(0, T, i) for the smallest integer
i with exactly N steps. The expected values below were worked out by hand from that rule: the exact
position j * frac_stride as a fraction, and, where that is a tie (x + 1/2), the float the cursor
actually holds after j additions (which is what decides it).
"""
import pytest

from ddpmrepro.params import ParamsError, from_dict
from ddpmrepro.respace import space_timesteps


def test_the_issue_example_keeps_149_not_150():
    # T=300, "10,15,20": three sections of 100 steps.
    # 1st: stride 99/9 = 11 exactly: 0, 11, ..., 99.
    # 2nd: stride 99/14; j=7 is 99/2 = 49.5, a tie, but the cursor holds 49.49999999999999 -> 49.
    #      The others are plain roundings of 99j/14: 0 7.07 14.14 21.21 28.29 35.36 42.43 | 56.57
    #      63.64 70.71 77.79 84.86 91.93 99.
    # 3rd: stride 99/19, no ties (19 divides no 198j for 0 < j < 19): round(99j/19).
    first = list(range(0, 100, 11))
    second = [100 + x for x in (0, 7, 14, 21, 28, 35, 42, 49, 57, 64, 71, 78, 85, 92, 99)]
    third = [200 + x for x in (0, 5, 10, 16, 21, 26, 31, 36, 42, 47, 52, 57, 63, 68, 73, 78, 83, 89, 94, 99)]
    assert sorted(space_timesteps(300, "10,15,20")) == first + second + third
    assert 149 in space_timesteps(300, [10, 15, 20]) and 150 not in space_timesteps(300, [10, 15, 20])


@pytest.mark.parametrize("T, counts, expected", [
    # stride 5/2: 0, 2.5 (exact in binary: a true tie, to even -> 2), 5.0
    (6, "3", [0, 2, 5]),
    # stride 15/14; j=7 is 15/2 = 7.5, the cursor holds 7.499999999999999 -> 7 (ties-to-even would give 8);
    # the last position is 14.999999999999998 -> 15
    (16, "15", [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15]),
    # stride 25/12; j=6 is 25/2 = 12.5, the cursor holds 12.500000000000002 -> 13 (ties-to-even: 12);
    # others: 2.08 4.17 6.25 8.33 10.42 | 14.58 16.67 18.75 20.83 22.92 25
    (26, "13", [0, 2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23, 25]),
    # T=10 in 3 sections: sizes 4, 3, 3 (the first T mod 3 = 1 section is one longer).
    # 4 steps keep 3: stride 3/2: 0, 1.5 (tie, exact: to even -> 2), 3; then stride 1 in each other section.
    (10, "3,3,3", [0, 2, 3, 4, 5, 6, 7, 8, 9]),
    # one step per section keeps the section's start (stride 1, one position)
    (10, "1,1", [0, 5]),
    (7, "1", [0]),
    # count == size keeps the whole section; spaces around counts are allowed
    (10, " 5 , 5 ", list(range(10))),
    (12, "", list(range(12))),  # "" keeps every step
])
def test_sections_match_improved_diffusions_float_cursor(T, counts, expected):
    assert sorted(space_timesteps(T, counts)) == expected


@pytest.mark.parametrize("T, name, expected", [
    (1000, "ddim50", list(range(0, 1000, 20))),
    (1000, "ddim3", [0, 334, 668]),       # ceil(1000 / i) = 3 first at i = 334 (333 gives 4)
    (10, "ddim4", [0, 3, 6, 9]),          # i = 3
    (10, "ddim10", list(range(10))),      # i = 1
    (4000, "ddim100", list(range(0, 4000, 40))),
    (2, "ddim2", [0, 1]),
])
def test_ddim_uses_the_smallest_integer_stride_with_exactly_n_steps(T, name, expected):
    assert sorted(space_timesteps(T, name)) == expected


@pytest.mark.parametrize("T, text, words", [
    (10, "ddim6", "nearest possible: 'ddim5' or 'ddim10'"),   # ceil(10/i): 10, 5, 4, 3, 2 ... no 6
    (1000, "ddim999", "nearest possible: 'ddim500' or 'ddim1000'"),
    (1000, "ddim1001", "nearest possible: 'ddim1000'"),       # more steps than T
    (1000, "ddim0", "nearest possible: 'ddim2'"),
    (1000, "ddim1", "nearest possible: 'ddim2'"),             # improved-diffusion's loop never tries i >= T
    (1000, "ddim", "is not 'ddimN'"),
    (1000, "ddim-5", "is not 'ddimN'"),
    (1000, "ddim2.5", "is not 'ddimN'"),
    (1000, "0,0", "section 1 of 2 covers 500 of the 1000 steps and cannot keep 0"),
    (1000, "10,0", "section 2 of 2 covers 500 of the 1000 steps and cannot keep 0"),
    (300, "10,150,20", "section 2 of 3 covers 100 of the 300 steps and cannot keep 150"),
    (10, "1,1,1,1,1,1,1,1,1,1,1", "11 sections but only 10 steps"),
    (1000, "fast", "is not '' (every step), 'ddimN', or comma-separated"),
    (1000, "10,,20", "is not ''"),
    (1000, "-5", "is not ''"),
    (1000, "1_0", "is not ''"),   # int() would read 10
    (1000, "١٠", "is not ''"),    # non-ASCII digits
    (1000, "10.5", "is not ''"),
])
def test_strings_that_cannot_respace_t_steps_are_refused_in_one_line(T, text, words):
    with pytest.raises(ValueError) as e:
        space_timesteps(T, text)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("raw, words", [
    ({"sample": {"respacing": "0,0"}}, "section 1 of 2"),
    ({"sample": {"respacing": "ddim50"}, "diffusion": {"timesteps": 40}}, "'ddim50'"),
    ({"sample": {"respacing": "10,15,20"}, "diffusion": {"timesteps": 30}}, "section 2 of 3 covers 10"),
    ({"sample": {"respacing": "garbage"}}, "is not ''"),
])
def test_params_refuse_what_the_respacer_refuses_naming_the_key_and_t(raw, words):
    with pytest.raises(ParamsError) as e:
        from_dict(raw)
    msg = str(e.value)
    assert msg.startswith("sample.respacing: ") and words in msg and "diffusion.timesteps" in msg and "\n" not in msg


def test_params_accept_what_the_respacer_accepts():
    for r in ("", "ddim50", "ddim1000", "10,15,20", "1000"):
        assert from_dict({"sample": {"respacing": r}}).sample.respacing == r
    assert from_dict({"sample": {"respacing": "ddim25"}, "diffusion": {"timesteps": 100}}).sample.respacing == "ddim25"
