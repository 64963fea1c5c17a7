"""``core.http.add_line``: the lines most messages do not carry (Host, Connection,
trailers) cost no list until one comes, and grow in place after that (a message with
thousands of such lines costs linear time, not a copy per line)."""

from activator.core.http import add_line


def test_the_first_line_makes_a_list_and_the_empty_tuple_stays_empty() -> None:
    none: tuple[()] = ()
    lines = add_line(none, b"a.example")
    assert lines == [b"a.example"]
    assert none == ()


def test_later_lines_are_appended_in_place_in_their_order() -> None:
    lines = add_line((), (b"X-One", b"1"))
    grown = lines
    for index in range(2, 1001):
        grown = add_line(grown, (b"X-More", b"%d" % index))
        assert grown is lines, "a new list per line: quadratic in the number of lines"
    assert lines[0] == (b"X-One", b"1")
    assert [value for _, value in lines[1:]] == [b"%d" % index for index in range(2, 1001)]
