/* Unit tests: the Jinja2 engine (src/text/jinja*.c).
 *
 * RENDER_CASES / ERROR_CASES were produced by jinja2 3.1.6 set up as transformers'
 * apply_chat_template sets it up (trim_blocks, lstrip_blocks, loopcontrols, transformers'
 * tojson, raise_exception): each feature is checked against the reference implementation. */
#include "support.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dflash/jinja.h"

struct render_case {
    const char *name, *tmpl, *vars, *expect;
};
struct error_case {
    const char *name, *tmpl, *vars, *message;
};
struct syntax_case {
    const char *name, *tmpl, *message;
};

/* Generated from jinja2 3.1.6 with transformers' environment (trim_blocks, lstrip_blocks,
 * loopcontrols, tojson override): template, variables, expected output. */
static const struct render_case RENDER_CASES[] = {
    {"text",
     "hello",
     "{}",
     "hello"},
    {"trailing_newline",
     "a\n",
     "{}",
     "a"},
    {"crlf",
     "a\r\nb\rc",
     "{}",
     "a\nb\nc"},
    {"var",
     "{{ x }}",
     "{\"x\": \"v\"}",
     "v"},
    {"types",
     "{{ 1 }} {{ 1.5 }} {{ true }} {{ none }} {{ [1, 'a', none, false] }} {{ {'k': 'v', 'n': 1} }}",
     "{}",
     "1 1.5 True None [1, 'a', None, False] {'k': 'v', 'n': 1}"},
    {"floats",
     "{{ 0.1 }} {{ 1e20 }} {{ 1e-5 }} {{ 3.0 }} {{ 2.5e15 }} {{ 1.0/3 }} {{ 10/4 }}",
     "{}",
     "0.1 1e+20 1e-05 3.0 2500000000000000.0 0.3333333333333333 2.5"},
    {"arith",
     "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ -3 + 1 }}",
     "{}",
     "3 -4 1 2 1024 7 9 -2"},
    {"concat",
     "{{ 'a' ~ 1 ~ none ~ true }} {{ 'a' + 'b' }} {{ [1] + [2] }} {{ 'ab' * 3 }}",
     "{}",
     "a1NoneTrue ab [1, 2] ababab"},
    {"strings",
     "{{ 'it\\'s' }} {{ \"q\\\"q\" }} {{ 'tab\\there' }} {{ 'nl\\nx' }} {{ '\\u00e9\\x41' }} {{ 'a' 'b' }}",
     "{}",
     "it's q\"q tab\there nl\nx \xc3""\xa9""A ab"},
    {"compare",
     "{{ 1 < 2 }} {{ 2 <= 1 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ 1 != 2 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ [1,2] < [1,3] }}",
     "{}",
     "True False True True True True False True"},
    {"logic",
     "{{ 1 and 2 }} {{ 0 and 2 }} {{ 0 or 'x' }} {{ not 1 }} {{ not none }} {{ none or [] }}",
     "{}",
     "2 0 x False True []"},
    {"in",
     "{{ 'a' in 'cat' }} {{ 2 in [1,2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'abc' }} {{ 'x' in undefined_thing }}",
     "{}",
     "True True True True False"},
    {"cond_expr",
     "{{ 'y' if x else 'n' }} {{ 'y' if not x else 'n' }} [{{ 'y' if false }}]",
     "{\"x\": 1}",
     "y n []"},
    {"if_elif",
     "{% for v in [1,2,3] %}{% if v == 1 %}one{% elif v == 2 %}two{% else %}many{% endif %} {% endfor %}",
     "{}",
     "one two many "},
    {"for_loop_vars",
     "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}",
     "{}",
     "1032TrueFalse3|2121FalseFalse3|3210FalseTrue3|"},
    {"for_prev_next",
     "{% for x in [1,2,3] %}{{ loop.previtem is defined }}{{ loop.previtem }}-{{ loop.nextitem }};{% endfor %}",
     "{}",
     "False-2;True1-3;True2-;"},
    {"for_else",
     "{% for x in [] %}x{% else %}empty{% endfor %}{% for x in [1] %}{{ x }}{% else %}no{% endfor %}",
     "{}",
     "empty1"},
    {"for_dict_items",
     "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in d|items %}{{ k }}{% endfor %}{% for k in d %}{{ k }}{% endfor %}",
     "{\"d\": {\"b\": 1, \"a\": 2}}",
     "b=1;a=2;baba"},
    {"for_filter",
     "{% for x in range(10) if x is odd %}{{ x }}{{ loop.length }},{% endfor %}",
     "{}",
     "15,35,55,75,95,"},
    {"for_break_continue",
     "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}",
     "{}",
     "0134"},
    {"for_nested_loop",
     "{% for a in [1,2] %}{% for b in [3,4] %}{{ loop.index }}{{ a }}{{ b }} {% endfor %}{{ loop.index }}|{% endfor %}",
     "{}",
     "113 214 1|123 224 2|"},
    {"loop_cycle",
     "{% for x in range(5) %}{{ loop.cycle('a', 'b') }}{% endfor %}",
     "{}",
     "ababa"},
    {"set_scope",
     "{% set x = 1 %}{% for i in [1,2] %}{% set x = i %}{{ x }}{% endfor %}{{ x }}",
     "{}",
     "121"},
    {"namespace",
     "{% set ns = namespace(total=0, seen=false) %}{% for i in [1,2,3] %}{% set ns.total = ns.total + i %}{% endfor %}{{ ns.total }} {{ ns.seen }}",
     "{}",
     "6 False"},
    {"set_block",
     "{% set b %}inner {{ 1 + 1 }}{% endset %}[{{ b }}]",
     "{}",
     "[inner 2]"},
    {"set_tuple",
     "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = (1, 2) %}{{ t[0] }}",
     "{}",
     "121"},
    {"macro",
     "{% macro m(a, b=2, c='x') %}{{ a }}-{{ b }}-{{ c }}{% endmacro %}{{ m(1) }} {{ m(1, 3) }} {{ m(1, c='z') }} {{ m(a=5) }}",
     "{}",
     "1-2-x 1-3-x 1-2-z 5-2-x"},
    {"macro_trim",
     "{%- macro m(x) %}\n  {{ x }}  \n{% endmacro %}[{{ m('v')|trim }}]",
     "{}",
     "[v]"},
    {"macro_globals",
     "{% set ns = namespace(n=0) %}{% macro inc() %}{% set ns.n = ns.n + 1 %}{{ g }}{% endmacro %}{{ inc() }}{{ inc() }}{{ ns.n }}",
     "{\"g\": \"G\"}",
     "GG2"},
    {"slicing",
     "{{ [1,2,3,4][::-1] }} {{ [1,2,3,4][1:] }} {{ [1,2,3,4][:2] }} {{ [1,2,3,4][-2:] }} {{ 'hello'[1:3] }} {{ 'h\xc3""\xa9""llo'[::-1] }} {{ [1,2,3,4,5][::2] }} {{ [1,2,3][5:] }} {{ [1,2,3,4][-1:0:-1] }}",
     "{}",
     "[4, 3, 2, 1] [2, 3, 4] [1, 2] [3, 4] el oll\xc3""\xa9""h [1, 3, 5] [] [4, 3, 2]"},
    {"subscripts",
     "{{ d['a'] }} {{ d.a }} {{ l[0] }} {{ l[-1] }} {{ l.1 }} {{ 'abc'[1] }} {{ d['missing'] is defined }} {{ d.a.b is defined }}",
     "{\"d\": {\"a\": {\"b\": 1}}, \"l\": [10, 20]}",
     "{'b': 1} {'b': 1} 10 20 20 b False True"},
    {"tests",
     "{{ 'a' is string }} {{ 1 is string }} {{ {} is mapping }} {{ [] is mapping }} {{ [] is iterable }} {{ 'a' is iterable }} {{ 1 is iterable }} {{ [] is sequence }} {{ {} is sequence }} {{ 1 is number }} {{ 1.5 is number }} {{ true is number }} {{ 'x' is number }}",
     "{}",
     "True False True False True True False True True True True True False"},
    {"tests2",
     "{{ x is defined }} {{ y is defined }} {{ y is undefined }} {{ none is none }} {{ 0 is none }} {{ true is true }} {{ 1 is true }} {{ false is false }} {{ 0 is false }} {{ x is not none }} {{ u is iterable }} {{ u is sequence }}",
     "{\"x\": 1}",
     "True False True True False True False True False True True True"},
    {"tests3",
     "{{ 4 is even }} {{ 3 is odd }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(2) }} {{ 1 is eq 1 }} {{ 1 is integer }} {{ 1.0 is float }} {{ true is boolean }} {{ 'abc' is lower }} {{ 'A' is upper }} {{ 2 is in [1,2] }} {{ none is sameas none }}",
     "{}",
     "True True True False True True True True True True True True"},
    {"tojson",
     "{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ '\xc3""\xa9""\"\\n'|tojson }}|{{ [1.0, 0.5, none, true]|tojson }}|{{ {}|tojson }}|{{ []|tojson(indent=2) }}|{{ {'b':1,'a':2}|tojson(sort_keys=true) }}",
     "{\"d\": {\"a\": [1, {\"b\": \"x\"}], \"c\": \"\\u00fc\"}}",
     "{\"a\": [1, {\"b\": \"x\"}], \"c\": \"\xc3""\xbc""\"}|{\n  \"a\": [\n    1,\n    {\n      \"b\": \"x\"\n    }\n  ],\n  \"c\": \"\xc3""\xbc""\"\n}|\"\xc3""\xa9""\\\"\\n\"|[1.0, 0.5, null, true]|{}|[]|{\"a\": 2, \"b\": 1}"},
    {"filters_str",
     "{{ '  x  '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ 'AbC'|lower }}|{{ 'abc'|upper }}|{{ 'aXa'|replace('a', 'b') }}|{{ 'hello world'|capitalize }}|{{ 'hello big-world'|title }}|{{ 1|string }}|{{ none|string }}|{{ 'a'|safe }}",
     "{}",
     "x|a|abc|ABC|bXb|Hello world|Hello Big-World|1|None|a"},
    {"filters_seq",
     "{{ [1,2,3]|length }} {{ 'h\xc3""\xa9""llo'|length }} {{ {'a':1}|length }} {{ [1,2]|join(',') }} {{ ['a','b']|join }} {{ [1,2]|first }} {{ [1,2]|last }} {{ 'abc'|first }} {{ [3,1,2]|sort }} {{ [3,1,2]|sort(reverse=true) }} {{ [1,2]|reverse|list }} {{ 'abc'|list }} {{ [1,1,2]|unique|list }}",
     "{}",
     "3 5 1 1,2 ab 1 2 a [1, 2, 3] [3, 2, 1] [2, 1] ['a', 'b', 'c'] [1, 2]"},
    {"filters_default",
     "{{ x|default('d') }} {{ y|default('d') }} {{ ''|default('d') }} {{ ''|default('d', true) }} {{ y|d('z') }} {{ none|default('d') }}",
     "{\"x\": \"v\"}",
     "v d  d z None"},
    {"filters_items",
     "{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}{{ d|items|list|length }} {{ u|items|list }}",
     "{\"d\": {\"a\": 1, \"b\": [2]}}",
     "a=1;b=[2];2 []"},
    {"filters_num",
     "{{ '42'|int + 1 }} {{ 'x'|int }} {{ '3.7'|int }} {{ 3.7|int }} {{ '2.5'|float }} {{ -3|abs }} {{ 2.567|round(2) }} {{ 2.5|round }} {{ [1,2,3]|sum }} {{ [3,1,2]|min }} {{ [3,1,2]|max }}",
     "{}",
     "43 0 3 3 2.5 3 2.57 2.0 6 1 3"},
    {"filters_map_select",
     "{{ users|map(attribute='name')|join(',') }} {{ users|selectattr('admin')|map(attribute='name')|list }} {{ users|rejectattr('admin')|list|length }} {{ [1,2,3,4]|select('odd')|list }} {{ [1,2,3,4]|reject('odd')|list }} {{ ['a','b']|map('upper')|list }}",
     "{\"users\": [{\"name\": \"x\", \"admin\": true}, {\"name\": \"y\", \"admin\": false}]}",
     "x,y ['x'] 1 [1, 3] [2, 4] ['A', 'B']"},
    {"dictsort",
     "{% for k, v in {'b':1,'a':2}|dictsort %}{{ k }}{{ v }}{% endfor %} {% for k, v in {'b':1,'a':2}|dictsort(by='value') %}{{ k }}{{ v }}{% endfor %}",
     "{}",
     "a2b1 b1a2"},
    {"str_methods",
     "{{ 'abc'.startswith('a') }} {{ 'abc'.endswith('bc') }} {{ 'abc'.startswith(('x','a')) }} {{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a,b,c'.rsplit(',', 1) }} {{ '  x '.strip() }}|{{ '\\n\\nx\\n'.lstrip('\\n') }}|{{ 'x\\n\\n'.rstrip('\\n') }}|{{ 'Ab'.upper() }}{{ 'Ab'.lower() }} {{ 'aaa'.replace('a', 'b', 2) }} {{ '-'.join(['a','b']) }} {{ 'abc'.find('c') }} {{ 'abcabc'.count('b') }} {{ 'hello world'.title() }}",
     "{}",
     "True True True ['a', 'b', '', 'c'] ['a', 'b'] ['a', 'b c'] ['a,b', 'c'] x|x\n|x|ABab bba a-b 2 2 Hello World"},
    {"dict_methods",
     "{{ d.keys()|list }} {{ d.values()|list }} {{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 5) }} {{ d.items()|list|length }}",
     "{\"d\": {\"a\": 1, \"b\": 2}}",
     "['a', 'b'] [1, 2] 1 None 5 2"},
    {"whitespace_ctl",
     "a  {{- 'b' -}}  c\n  {%- if true -%}\n  d  \n{%- endif -%}  e {#- comment -#} f",
     "{}",
     "abcdef"},
    {"trim_lstrip",
     "<ul>\n  {% for x in [1,2] %}\n    <li>{{ x }}</li>\n  {% endfor %}\n</ul>\n",
     "{}",
     "<ul>\n    <li>1</li>\n    <li>2</li>\n</ul>"},
    {"lstrip_plus",
     "x\n  {%+ if true %}y{% endif %}\n  {# c #}\nz",
     "{}",
     "x\n  yz"},
    {"trim_var_end",
     "{{ 'a' }}\n{{ 'b' }}\n{% if true %}\nc\n{% endif %}\n",
     "{}",
     "a\nb\nc\n"},
    {"comments",
     "a{# comment #}b\n{# line comment #}\nc",
     "{}",
     "ab\nc"},
    {"raw",
     "{% raw %}{{ not evaluated }}{% endraw %}",
     "{}",
     "{{ not evaluated }}"},
    {"range",
     "{{ range(3)|list }} {{ range(1, 4)|list }} {{ range(10, 0, -3)|list }}",
     "{}",
     "[0, 1, 2] [1, 2, 3] [10, 7, 4, 1]"},
    {"dict_literal",
     "{% set d = {'a': 1, 'b': [1, 2], 'c': {'x': none}} %}{{ d.b[1] }} {{ d.c.x }} {{ d|tojson }}",
     "{}",
     "2 None {\"a\": 1, \"b\": [1, 2], \"c\": {\"x\": null}}"},
    {"unicode",
     "{{ '\xc3""\xbc""'|upper }} {{ '\xc3""\x84""\xc3""\x96""'|lower }} {{ 'n\xc3""\xa4""me'|length }} {{ '\xe6""\x97""\xa5""\xe6""\x9c""\xac""\xe8""\xaa""\x9e""'[1] }}",
     "{}",
     "\xc3""\x9c"" \xc3""\xa4""\xc3""\xb6"" 4 \xe6""\x9c""\xac"""},
    {"unary_filter",
     "{{ -1|abs }} {{ -(1)|abs }} {{ not 0 is none }}",
     "{}",
     "1 1 True"},
    {"none_attr",
     "{{ x.y is defined }}",
     "{\"x\": null}",
     "False"},
    {"str_of_undef_concat",
     "[{{ u ~ 'x' }}]",
     "{}",
     "[x]"},
    {"tojson_nested_indent",
     "{{ {'a': {'b': [1, 2]}, 'c': []}|tojson(indent=4) }}",
     "{}",
     "{\n    \"a\": {\n        \"b\": [\n            1,\n            2\n        ]\n    },\n    \"c\": []\n}"},
    {"indent",
     "{{ 'a\nb\n\nc'|indent }}|{{ 'a\nb\n\nc'|indent(2, true, true) }}|{{ 'x\ny'|indent('> ') }}",
     "{}",
     "a\n    b\n\n    c|  a\n  b\n  \n  c|x\n> y"},
    {"escape",
     "{{ '<a href=\\'x\\'>&\"'|e }} {{ '<b>'|escape }}",
     "{}",
     "&lt;a href=&#39;x&#39;&gt;&amp;&#34; &lt;b&gt;"},
    {"unknown_filter_untaken",
     "{% if false %}{{ x|nope }}{{ x is nope }}{% endif %}ok",
     "{}",
     "ok"},
    {"string_escape_repr",
     "{{ ['a\\'b', 'a\"b', \"a'b\\\"c\", 'x\\ny'] }}",
     "{}",
     "[\"a'b\", 'a\"b', 'a\\'b\"c', 'x\\ny']"},
};

/* Run-time errors: jinja2's message; ours appends " (template line L, column C)". */
static const struct error_case ERROR_CASES[] = {
    {"raise", "{{ raise_exception('boom: ' ~ 1) }}", "{}",
     "boom: 1"},
    {"undef_attr", "x\n{{ foo.bar }}", "{}",
     "'foo' is undefined (template line 2, column 7)"},
    {"list_method", "{{ x.startswith('a') }}", "{\"x\": [1]}",
     "'list object' has no attribute 'startswith' (template line 1, column 16)"},
    {"none_call", "{{ none() }}", "{}",
     "'NoneType' object is not callable (template line 1, column 8)"},
    {"add_types", "{{ 1 + 'a' }}", "{}",
     "unsupported operand type(s) for +: 'int' and 'str' (template line 1, column 6)"},
    {"str_plus_int", "{{ 'a' + 1 }}", "{}",
     "can only concatenate str (not \"int\") to str (template line 1, column 8)"},
    {"div_zero", "{{ 1 / 0 }}", "{}",
     "division by zero (template line 1, column 6)"},
    {"undef_compare", "{{ u < 1 }}", "{}",
     "'u' is undefined (template line 1, column 4)"},
    {"tojson_undef", "{{ u|tojson }}", "{}",
     "Object of type Undefined is not JSON serializable (template line 1, column 6)"},
    {"items_non_map", "{{ [1]|items|list }}", "{}",
     "Can only get item pairs from a mapping. (template line 1, column 8)"},
    {"elem0", "{{ x[0].role }}", "{\"x\": []}",
     "list object has no element 0 (template line 1, column 8)"},
    {"len_int", "{{ 1|length }}", "{}",
     "object of type 'int' has no len() (template line 1, column 6)"},
    {"iter_int", "{% for x in 1 %}{% endfor %}", "{}",
     "'int' object is not iterable (template line 1, column 13)"},
    {"unpack", "{% for a, b in [[1,2,3]] %}{% endfor %}", "{}",
     "too many values to unpack (expected 2) (template line 1, column 4)"},
    {"macro_too_many", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "{}",
     "macro 'm' takes not more than 1 argument(s) (template line 1, column 35)"},
    {"macro_bad_kw", "{% macro m(a) %}{% endmacro %}{{ m(b=2) }}", "{}",
     "macro 'm' takes no keyword argument 'b' (template line 1, column 35)"},
    {"split_empty", "{{ 'a'.split('') }}", "{}",
     "empty separator (template line 1, column 13)"},
    {"in_string_int", "{{ 1 in 'abc' }}", "{}",
     "'in <string>' requires string as left operand, not int (template line 1, column 4)"},
    {"unknown_filter", "{{ x|nope }}", "{}",
     "No filter named 'nope'. (template line 1, column 6)"},
    {"unknown_test", "{{ x is nope }}", "{}",
     "No test named 'nope'. (template line 1, column 9)"},
};

static const struct syntax_case SYNTAX_CASES[] = {
    {"unclosed_if", "{% if x %}\nabc",
     "template syntax error at line 1, column 4: unexpected end of template, expected '{% endif %}' (for the tag opened here)"},
    {"unknown_tag", "a\n  {% frobnicate %}",
     "template syntax error at line 2, column 6: unknown tag 'frobnicate'"},
    {"bad_expr", "{{ 1 + }}",
     "template syntax error at line 1, column 8: unexpected '}}', expected an expression"},
    {"unclosed_var", "{{ x ",
     "template syntax error at line 1, column 1: unexpected end of template, expected '}}'"},
    {"unclosed_string", "{{ 'abc }}",
     "template syntax error at line 1, column 4: unterminated string literal"},
    {"endfor_without_for", "{% endfor %}",
     "template syntax error at line 1, column 4: unexpected 'endfor'"},
    {"unclosed_comment", "{# abc",
     "template syntax error at line 1, column 1: unterminated comment"},
    {"bad_char", "{{ x $ y }}",
     "template syntax error at line 1, column 6: unexpected character $"},
    {"unbalanced", "{{ (1 }}",
     "template syntax error at line 1, column 7: unbalanced bracket }"},
    {"include", "{% include 'x' %}",
     "template syntax error at line 1, column 4: the 'include' tag is not supported"},
};

/* Renders tmpl with vars (JSON text); returns the status, *out the text (caller frees). */
static df_status render(const char *tmpl, const char *vars_json, const df_jinja_limits *lim, char **out,
                        df_error *err) {
    df_jinja_template *t = NULL;
    *out = NULL;
    df_status st = df_jinja_parse(tmpl, strlen(tmpl), &t, err);
    if (st) return st;
    json_t *vars = vars_json ? json_loads(vars_json, 0, NULL) : NULL;
    st = df_jinja_render(t, vars, lim, out, NULL, err);
    json_decref(vars);
    df_jinja_free(t);
    return st;
}

static void test_render_cases(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof RENDER_CASES / sizeof RENDER_CASES[0]; i++) {
        const struct render_case *c = &RENDER_CASES[i];
        df_error err = {0};
        char *out;
        df_status st = render(c->tmpl, c->vars, NULL, &out, &err);
        if (st != DF_OK || strcmp(out, c->expect) != 0)
            fail_msg("case %s: status %d (%s)\n got      [%s]\n expected [%s]", c->name, st, err.msg, out ? out : "",
                     c->expect);
        free(out);
    }
}

static void test_error_cases(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof ERROR_CASES / sizeof ERROR_CASES[0]; i++) {
        const struct error_case *c = &ERROR_CASES[i];
        df_error err = {0};
        char *out;
        df_status st = render(c->tmpl, c->vars, NULL, &out, &err);
        if (st != DF_ERR_INVALID_ARG || strcmp(err.msg, c->message) != 0)
            fail_msg("case %s: status %d\n got      [%s]\n expected [%s]", c->name, st, err.msg, c->message);
        assert_null(out);
    }
}

static void test_syntax_errors(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof SYNTAX_CASES / sizeof SYNTAX_CASES[0]; i++) {
        const struct syntax_case *c = &SYNTAX_CASES[i];
        df_error err = {0};
        char *out;
        df_status st = render(c->tmpl, "{}", NULL, &out, &err);
        if (st != DF_ERR_FORMAT || strcmp(err.msg, c->message) != 0)
            fail_msg("case %s: status %d\n got      [%s]\n expected [%s]", c->name, st, err.msg, c->message);
    }
}

/* Error positions on later lines and columns counted in characters. */
static void test_error_position(void **state) {
    (void)state;
    df_error err = {0};
    char *out;
    assert_int_equal(render("line one\n{% if true %}\n  é {{ x.y.z }}\n{% endif %}", "{\"x\": {}}", NULL, &out, &err),
                     DF_ERR_INVALID_ARG);
    assert_string_equal(err.msg, "'dict object' has no attribute 'y' (template line 3, column 11)");
    assert_int_equal(render("a\n\n   {{ 1 +* 2 }}", NULL, NULL, &out, &err), DF_ERR_FORMAT);
    assert_string_equal(err.msg, "template syntax error at line 3, column 10: unexpected '*', expected an expression");
    assert_int_equal(render("{% for x in y %}\n{% endif %}", NULL, NULL, &out, &err), DF_ERR_FORMAT);
    assert_string_equal(err.msg, "template syntax error at line 2, column 4: unexpected 'endif'");
    /* invalid UTF-8 in the template itself */
    assert_int_equal(render("ab\xff", NULL, NULL, &out, &err), DF_ERR_FORMAT);
    assert_string_equal(err.msg, "template is not valid UTF-8 (byte 2)");
}

static void test_limits(void **state) {
    (void)state;
    df_error err = {0};
    char *out;
    df_jinja_limits lim = {.max_steps = 1000};
    assert_int_equal(render("{% for i in range(100000) %}{{ i }}{% endfor %}", NULL, &lim, &out, &err), DF_ERR_RANGE);
    lim = (df_jinja_limits){.max_output = 100};
    assert_int_equal(render("{% for i in range(1000) %}xx{% endfor %}", NULL, &lim, &out, &err), DF_ERR_RANGE);
    assert_int_equal(render("{{ 'x' * 1000 }}", NULL, &lim, &out, &err), DF_ERR_RANGE);
    assert_int_equal(render("{{ 'x' * 10 }}", NULL, &lim, &out, &err), DF_OK);
    free(out);
    /* a value longer than the limit, printed or through a filter: the limit is named (not
     * "out of memory", which it is not) */
    char big[400];
    snprintf(big, sizeof big, "{\"s\": \"%0300d\"}", 0);
    assert_int_equal(render("ab{{ s }}", big, &lim, &out, &err), DF_ERR_RANGE);
    assert_non_null(strstr(err.msg, "template output exceeds the limit of 100 bytes"));
    assert_int_equal(render("ab{{ s|upper }}", big, &lim, &out, &err), DF_ERR_RANGE);
    assert_non_null(strstr(err.msg, "exceeds the limit"));
    lim = (df_jinja_limits){.max_depth = 10};
    assert_int_equal(render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, &lim, &out, &err),
                     DF_ERR_RANGE);
    assert_non_null(strstr(err.msg, "macro calls nested deeper than 10"));
    assert_int_equal(render("{{ range(100000000)|length }}", NULL, NULL, &out, &err), DF_ERR_RANGE);
    /* deep nesting is a syntax error, not a stack overflow */
    char deep[2100];
    memset(deep, '(', 1000);
    memcpy(deep + 1000, "1", 1);
    memset(deep + 1001, ')', 1000);
    deep[2001] = 0;
    char tmpl[2200];
    snprintf(tmpl, sizeof tmpl, "{{ %s }}", deep);
    assert_int_equal(render(tmpl, NULL, NULL, &out, &err), DF_ERR_FORMAT);
}

static void test_namespace_and_loops_escape(void **state) {
    (void)state;
    df_error err = {0};
    char *out;
    /* a loop stored in a namespace outlives its loop as a snapshot */
    assert_int_equal(render("{% set ns = namespace(l=none) %}{% for x in [1,2] %}{% set ns.l = loop %}{% endfor %}"
                            "{{ ns.l.index }}{{ ns.l.last }}{{ ns.l.previtem }}",
                            NULL, NULL, &out, &err),
                     DF_OK);
    assert_string_equal(out, "2True1");
    free(out);
    assert_int_equal(render("{% set a = namespace() %}{% set b = namespace() %}{% set a.b = b %}", NULL, NULL, &out, &err),
                     DF_ERR_INVALID_ARG);
    /* assigning an attribute of something that is not a namespace */
    assert_int_equal(render("{% set d = {} %}{% set d.x = 1 %}", NULL, NULL, &out, &err), DF_ERR_INVALID_ARG);
    assert_string_equal(err.msg, "cannot assign attribute on non-namespace object (template line 1, column 20)");
}

static void test_dump_json(void **state) {
    (void)state;
    df_error err = {0};
    char *out;
    size_t len;
    json_t *v = json_loads("{\"b\": [1, 2.5, 1e-05, 1e16, 100.0, true, null], \"a\": \"é\\n\\u0001\", \"c\": {}}", 0, NULL);
    assert_int_equal(df_jinja_dump_json(v, -1, 0, &out, &len, &err), DF_OK);
    assert_string_equal(out, "{\"b\": [1, 2.5, 1e-05, 1e+16, 100.0, true, null], \"a\": \"é\\n\\u0001\", \"c\": {}}");
    assert_int_equal(len, strlen(out));
    free(out);
    assert_int_equal(df_jinja_dump_json(v, 2, 1, &out, NULL, &err), DF_OK);
    assert_string_equal(out, "{\n  \"a\": \"é\\n\\u0001\",\n  \"b\": [\n    1,\n    2.5,\n    1e-05,\n    1e+16,\n"
                             "    100.0,\n    true,\n    null\n  ],\n  \"c\": {}\n}");
    free(out);
    json_decref(v);
}

/* cases.json rendered directly (conversation keys as template variables). The err_empty
 * conversation is refused by transformers before the template runs: test_chat checks it. */
static void test_fixture_templates(void **state) {
    (void)state;
    json_t *cases = json_load_file(tu_fixture("chat-templates/cases.json"), 0, NULL);
    assert_non_null(cases);
    json_t *renders = json_object_get(cases, "renders"), *convs = json_object_get(cases, "convs");
    const char *key;
    json_t *exp;
    int checked = 0;
    json_object_foreach(renders, key, exp) {
        char tname[64];
        const char *slash = strchr(key, '/');
        snprintf(tname, sizeof tname, "chat-templates/%s.jinja",
                 !strncmp(key, "qwen35/", 7) ? "qwen3.5" : "qwen3");
        if (!strcmp(slash + 1, "err_empty")) continue;
        size_t len;
        char *src = tu_read_file(tu_fixture(tname), &len);
        assert_non_null(src);
        df_jinja_template *t;
        df_error err = {0};
        assert_int_equal(df_jinja_parse(src, len, &t, &err), DF_OK);
        json_t *vars = json_deep_copy(json_object_get(convs, slash + 1));
        json_object_set_new(vars, "add_generation_prompt", json_true());
        char *out = NULL;
        df_status st = df_jinja_render(t, vars, NULL, &out, NULL, &err);
        if (json_is_true(json_object_get(exp, "ok"))) {
            if (st != DF_OK || strcmp(out, json_string_value(json_object_get(exp, "text"))))
                fail_msg("%s: status %d (%s)\n got [%s]", key, st, err.msg, out ? out : "");
        } else {
            const char *msg = json_string_value(json_object_get(exp, "error"));
            if (st != DF_ERR_INVALID_ARG || strncmp(err.msg, msg, strlen(msg)) ||
                (err.msg[strlen(msg)] && strncmp(err.msg + strlen(msg), " (template line ", 16)))
                fail_msg("%s: status %d, message [%s], expected [%s]", key, st, err.msg, msg);
        }
        checked++;
        free(out);
        json_decref(vars);
        df_jinja_free(t);
        free(src);
    }
    assert_int_equal(checked, 14);
    json_decref(cases);
}

static void test_content_list_detection(void **state) {
    (void)state;
    const char *names[] = {"chat-templates/qwen3.5.jinja", "chat-templates/qwen3.jinja"};
    int expect[] = {1, 0};
    for (int i = 0; i < 2; i++) {
        size_t len;
        char *src = tu_read_file(tu_fixture(names[i]), &len);
        df_jinja_template *t;
        df_error err = {0};
        assert_int_equal(df_jinja_parse(src, len, &t, &err), DF_OK);
        assert_int_equal(df_jinja_handles_content_lists(t), expect[i]);
        df_jinja_free(t);
        free(src);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_render_cases),
        cmocka_unit_test(test_error_cases),
        cmocka_unit_test(test_syntax_errors),
        cmocka_unit_test(test_error_position),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_namespace_and_loops_escape),
        cmocka_unit_test(test_dump_json),
        cmocka_unit_test(test_fixture_templates),
        cmocka_unit_test(test_content_list_detection),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
