from miles_plugin_multi_turn.parsing import parse_tool_calls

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'


def test_hermes_one_call():
    [c] = parse_tool_calls("let me compute " + CALL)
    assert (c.name, c.arguments, c.error) == ("calculator", {"expression": "2*3"}, None)


def test_hermes_several_calls_in_one_turn_keep_their_order():
    text = CALL + "\n" + CALL.replace("2*3", "4+5").replace("calculator", "calc2")
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments["expression"]) for c in calls] == [("calculator", "2*3"), ("calc2", "4+5")]


def test_hermes_arguments_as_json_string_and_missing_arguments():
    [c] = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert c.arguments == {"x": 1} and c.error is None
    [c] = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert c.arguments == {} and c.error is None


def test_hermes_malformed_calls_each_get_an_error_without_hiding_the_good_one():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "2*3</tool_call>'  # bad JSON
            '<tool_call>{"arguments": {}}</tool_call>'  # no name
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'  # arguments not an object
            + CALL + '<tool_call>{"name": "g"')  # unterminated
    calls = parse_tool_calls(text)
    assert [c.error is None for c in calls] == [False, False, False, True, False]
    assert "JSON" in calls[0].error and "name" in calls[1].error and "object" in calls[2].error
    assert "unterminated" in calls[4].error
    assert calls[3].name == "calculator"


def test_an_answer_has_no_calls():
    assert parse_tool_calls("=29842") == []
    assert parse_tool_calls("the tool_call tag is <tool_call") == []


def test_function_tag_format():
    calls = parse_tool_calls('<function=calculator>{"expression": "1+1"}</function> and '
                             '<function=python>{"code": "print(1)"}</function>', "function_tag")
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "1+1"}),
                                                      ("python", {"code": "print(1)"})]
    bad = parse_tool_calls('<function=>{}</function><function=f>{oops}</function><function=g>{}', "function_tag")
    assert [c.error is not None for c in bad] == [True, True, True]
    assert parse_tool_calls(CALL, "function_tag") == []  # formats do not mix
