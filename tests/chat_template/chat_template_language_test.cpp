// Unit tests for the language pieces. The expected renders in kCases were produced by Python
// jinja2 3.1 in transformers' environment (ImmutableSandboxedEnvironment, trim_blocks,
// lstrip_blocks, loopcontrols, generation tag, json.dumps tojson); error cases give a piece of
// jinja2's message that ours must contain too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>

#include "tokenizer/chat_template/chat_template.h"

namespace moat {
namespace {

using json = nlohmann::ordered_json;

struct Case {
  const char* name;
  const char* source;
  const char* context;
  const char* expected;
  const char* error;  // non-null: rendering must fail with a message containing this
};

const Case kCases[] = {
    {"text_only", R"J(hello
world
)J", R"J({})J", R"J(hello
world)J", nullptr},
    {"trailing_newlines", R"J(a

)J", R"J({})J", R"J(a
)J", nullptr},
    {"crlf", R"J(a
b{% if true %}
c{% endif %}
)J", R"J({})J", R"J(a
bc)J", nullptr},
    {"trim_blocks", R"J({% if true %}
yes
{% endif %}
after)J", R"J({})J", R"J(yes
after)J", nullptr},
    {"lstrip_blocks", R"J(line
    {% if true %}
    body
    {% endif %}
end)J", R"J({})J", R"J(line
    body
end)J", nullptr},
    {"lstrip_not_var", R"J(    {{ 'x' }}
  {# c #}
z)J", R"J({})J", R"J(    x
z)J", nullptr},
    {"minus_both", R"J(a   
  {%- if true -%}  
  b  
 {%- endif -%}

 c)J", R"J({})J", R"J(abc)J", nullptr},
    {"minus_var", R"J(a  {{- 'b' -}}  c {{ 'd' }} e)J", R"J({})J", R"J(abc d e)J", nullptr},
    {"plus_disables", R"J(x
    {%+ if true +%}
y{% endif %})J", R"J({})J", R"J(x
    
y)J", nullptr},
    {"comment_trim", R"J(a
{# comment #}
b {#- x -#}   c)J", R"J({})J", R"J(a
bc)J", nullptr},
    {"raw", R"J({% raw %}{{ not parsed }}{% endraw %}!)J", R"J({})J", R"J({{ not parsed }}!)J", nullptr},
    {"inline_text_before_tag", R"J(ab  {% if true %}x{% endif %})J", R"J({})J", R"J(ab  x)J", nullptr},
    {"values_print", R"J({{ none }}|{{ true }}|{{ 1 }}|{{ 1.0 }}|{{ 1.5e-7 }}|{{ 1e20 }}|{{ 0.1 + 0.2 }}|{{ [1, 'a', "it's", none, true, 2.5] }}|{{ {'k': 'v', 'n': [1]} }}|{{ (1,) }}|{{ (1, 'b') }}|{{ 'a' 'b' }})J", R"J({})J", R"J(None|True|1|1.0|1.5e-07|1e+20|0.30000000000000004|[1, 'a', "it's", None, True, 2.5]|{'k': 'v', 'n': [1]}|(1,)|(1, 'b')|ab)J", nullptr},
    {"arith", R"J({{ 7 / 2 }} {{ 6 / 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 1 + 2.0 }} {{ 'ab' * 3 }} {{ [1] * 2 }} {{ 3 - 5 }} {{ -x }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ true + 1 }})J", R"J({"x": 4})J", R"J(3.5 2.0 3 -4 2 -2 1024 0.5 3.0 ababab [1, 1] -2 -4 7 9 2)J", nullptr},
    {"concat", R"J({{ 'a' ~ 1 ~ none ~ undefined_var ~ [1] }}|{{ 'x' + 'y' }})J", R"J({})J", R"J(a1None[1]|xy)J", nullptr},
    {"compare", R"J({{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ [1, 2] == [1, 2] }} {{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'abc' }} {{ not 1 == 2 }} {{ none == none }} {{ 1 != 2 }})J", R"J({})J", R"J(True False True True True True True True True True True True)J", nullptr},
    {"logic", R"J({{ 0 or 'x' }} {{ 'a' and 'b' }} {{ '' and 'b' }} {{ none or [] }} {{ not none }} {{ 'y' if 0 else 'n' }} {{ 'y' if 1 }}|{{ 'y' if 0 }}|)J", R"J({})J", R"J(x b  [] True n y||)J", nullptr},
    {"strings", R"J({{ 'a\tb\n' }}|{{ "q\"x" }}|{{ 'caf\u00e9 \x41' }}|{{ 'back\\slash \d' }})J", R"J({})J", R"J(a	b
|q"x|café A|back\slash \d)J", nullptr},
    {"string_methods", R"J({{ ' ab '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\n\na\n'.lstrip('\n') }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a-b-c'.rsplit('-', 1) }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ 'aaa'.replace('a', 'b', 2) }}|{{ 'Hi'.upper() }}{{ 'Hi'.lower() }}|{{ 'hello world'.title() }}|{{ 'hELLO'.capitalize() }}|{{ 'abc'.find('c') }}|{{ '-'.join(['a', 'b']) }}|{{ '{} and {x}'.format(1, x=2) }})J", R"J({})J", R"J(ab|a|a
|['a', 'b', '', 'c']|['a', 'b']|['a', 'b c']|['a-b', 'c']|True|True|bba|HIhi|Hello World|Hello|2|a-b|1 and 2)J", nullptr},
    {"slicing", R"J({{ 'hello'[1:-1] }}|{{ 'hello'[::-1] }}|{{ [1,2,3,4][1:] }}|{{ [1,2,3,4][:-1] }}|{{ [1,2,3,4][::2] }}|{{ 'héllo'[1] }}|{{ 'héllo'|length }}|{{ [1,2,3][-1] }}|{{ 'abc'[5:] }}|{{ [1,2,3][::-1] }})J", R"J({})J", R"J(ell|olleh|[2, 3, 4]|[1, 2, 3]|[1, 3]|é|5|3||[3, 2, 1])J", nullptr},
    {"for_loop_vars", R"J({% for x in ['a', 'b', 'c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('o', 'e') }};{% endfor %})J", R"J({})J", R"J(1032TrueFalse3bo;2121FalseFalse3ace;3210FalseTrue3bo;)J", nullptr},
    {"for_else", R"J({% for x in [] %}{{ x }}{% else %}empty{% endfor %}|{% for x in none_var %}{{ x }}{% else %}undef{% endfor %})J", R"J({})J", R"J(empty|undef)J", nullptr},
    {"for_filter", R"J({% for x in range(10) if x is odd %}{{ x }}{{ '/' if loop.last else ',' }}{% endfor %} {{ loop }})J", R"J({})J", R"J(1,3,5,7,9/ )J", nullptr},
    {"for_unpack", R"J({% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}{% for (a, b) in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %})J", R"J({"d": {"z": 1, "a": 2}})J", R"J(z=1;a=2;za37)J", nullptr},
    {"for_string", R"J({% for ch in 'héy' %}[{{ ch }}]{% endfor %})J", R"J({})J", R"J([h][é][y])J", nullptr},
    {"break_continue", R"J({% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 4 %}{% break %}{% endif %}{{ x }}{% endfor %})J", R"J({})J", R"J(0134)J", nullptr},
    {"nested_loops", R"J({% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{{ a }}{{ b }} {% endfor %}{{ loop.index }}|{% endfor %})J", R"J({})J", R"J(11x 21y 1|12x 22y 2|)J", nullptr},
    {"scoping", R"J({% set x = 1 %}{% for i in [1, 2] %}{% set x = x + 10 %}{{ x }},{% endfor %}{{ x }}|{% if true %}{% set y = 5 %}{% endif %}{{ y }})J", R"J({})J", R"J(11,11,1|5)J", nullptr},
    {"namespace", R"J({% set ns = namespace(count=0, items=[]) %}{% for i in range(3) %}{% set ns.count = ns.count + i %}{% set ns.items = ns.items + [i] %}{% endfor %}{{ ns.count }} {{ ns.items }})J", R"J({})J", R"J(3 [0, 1, 2])J", nullptr},
    {"set_tuple", R"J({% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t }})J", R"J({})J", R"J(12(1, 2))J", nullptr},
    {"set_block", R"J({% set body %}
  x {{ 1 + 1 }}
{% endset %}[{{ body }}]{% set up | upper %}abc{% endset %}{{ up }})J", R"J({})J", R"J([  x 2
]ABC)J", nullptr},
    {"macro", R"J({% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('a') }} {{ greet('b', '?') }} {{ greet(punct='.', name='c') }} {{ greet() }})J", R"J({})J", R"J(Hi a! Hi b? Hi c. Hi !)J", nullptr},
    {"macro_recursion", R"J({% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1)|int }}{% endif %}{% endmacro %}{{ fact(5) }})J", R"J({})J", R"J(120)J", nullptr},
    {"macro_sees_globals", R"J({% macro m() %}{{ t }}{% endmacro %}{% set t = 5 %}{{ m() }})J", R"J({})J", R"J(5)J", nullptr},
    {"call_block", R"J({% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}inner{% endcall %})J", R"J({})J", R"J(<b>inner</b>)J", nullptr},
    {"filter_block", R"J({% filter upper %}abc {{ 'd' }}{% endfilter %})J", R"J({})J", R"J(ABC D)J", nullptr},
    {"generation", R"J({% generation %}gen {{ 1 }}{% endgeneration %})J", R"J({})J", R"J(gen 1)J", nullptr},
    {"filters_basic", R"J({{ '  x  '|trim }}|{{ [1,2,3]|length }}|{{ {'a':1}|length }}|{{ [1,2]|first }}{{ [1,2]|last }}|{{ undefined_x|default('dflt') }}|{{ ''|default('e', true) }}|{{ [1,2]|join(', ') }}|{{ 'ABC'|lower }}|{{ 'abc'|upper }}|{{ 'aXa'|replace('a', 'b') }}|{{ 12|string + '!' }}|{{ 'abc'|list }}|{{ '42'|int + 1 }}|{{ 'x'|int }}|{{ '3.7'|int }}|{{ 3.9|int }}|{{ '2.5'|float }}|{{ 'hello world'|capitalize }}|{{ 'hello world'|title }}|{{ [3,1,2]|sort }}|{{ [3,1,2]|sort(reverse=true) }}|{{ [1,2,2,1]|unique|list }}|{{ [1,2,3]|sum }}|{{ [4,2,8]|max }}{{ [4,2,8]|min }}|{{ -3|abs }}|{{ 2.567|round(2) }}|{{ 'x'|e }}{{ '<a&"b">'|escape }}|{{ [1,2]|reverse|list }}|{{ 'abc'|reverse }}|{{ '%s=%d'|format('a', 3) }}|{{ 'a b  c'|wordcount }})J", R"J({})J", R"J(x|3|1|12|dflt|e|1, 2|abc|ABC|bXb|12!|['a', 'b', 'c']|43|0|3|3|2.5|Hello world|Hello World|[1, 2, 3]|[3, 2, 1]|[1, 2]|6|82|3|2.57|x&lt;a&amp;&#34;b&#34;&gt;|[2, 1]|cba|a=3|3)J", nullptr},
    {"filters_items_dictsort", R"J({{ {'b': 1, 'a': 2}|items|list }}|{{ {'b': 1, 'A': 2, 'c': 0}|dictsort }}|{{ {'b': 1, 'a': 2}|dictsort(by='value') }}|{{ {'b': 1, 'a': 2}|dictsort(reverse=true) }})J", R"J({})J", R"J([('b', 1), ('a', 2)]|[('A', 2), ('b', 1), ('c', 0)]|[('b', 1), ('a', 2)]|[('b', 1), ('a', 2)])J", nullptr},
    {"filters_select", R"J({{ tools|selectattr('type', 'equalto', 'function')|map(attribute='function.name')|list }}|{{ tools|rejectattr('type', 'equalto', 'function')|list|length }}|{{ [1,2,3,4]|select('even')|list }}|{{ [1,0,2]|select|list }}|{{ [1,2]|reject('odd')|list }}|{{ ['a','b']|map('upper')|join }}|{{ tools|map(attribute='missing', default='d')|list }})J", R"J({"tools": [{"type": "function", "function": {"name": "f1"}}, {"type": "other"}, {"type": "function", "function": {"name": "f2"}}]})J", R"J(['f1', 'f2']|1|[2, 4]|[1, 2]|[2]|AB|['d', 'd', 'd'])J", nullptr},
    {"tojson", R"J({{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ 'é\n"'|tojson }}|{{ 'é'|tojson(ensure_ascii=true) }}|{{ d|tojson(sort_keys=true) }}|{{ [1.0, 2, none, true]|tojson }}|{{ d|tojson(separators=(',', ':')) }})J", R"J({"d": {"z": [1, {"y": "ü"}], "a": null, "e": {}, "l": []}})J", R"J({"z": [1, {"y": "ü"}], "a": null, "e": {}, "l": []}|{
  "z": [
    1,
    {
      "y": "ü"
    }
  ],
  "a": null,
  "e": {},
  "l": []
}|"é\n\""|"\u00e9"|{"a": null, "e": {}, "l": [], "z": [1, {"y": "ü"}]}|[1.0, 2, null, true]|{"z":[1,{"y":"ü"}],"a":null,"e":{},"l":[]})J", nullptr},
    {"indent", R"J({{ 'a\nb\n\nc'|indent }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent(width='> ', blank=true) }})J", R"J({})J", R"J(a
    b

    c|  a
  b|a
> 
> b)J", nullptr},
    {"tests", R"J({{ 1 is number }}{{ true is number }}{{ true is boolean }}{{ 1 is integer }}{{ 1.0 is float }}{{ 'a' is string }}{{ {} is mapping }}{{ [] is sequence }}{{ 'a' is sequence }}{{ none is none }}{{ x is defined }}{{ x is undefined }}{{ 4 is divisibleby 2 }}{{ 3 is odd }}{{ 2 is even }}{{ 1 is eq 1 }}{{ 'a' is in 'abc' }}{{ true is true }}{{ 0 is false }}{{ 'ab' is lower }}{{ [] is iterable }}{{ d.get is callable }}{{ 3 is gt 2 }}{{ 1 is sameas 1 }})J", R"J({"d": {}})J", R"J(TrueTrueTrueTrueTrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrue)J", nullptr},
    {"undefined_behaviour", R"J([{{ missing }}]{{ missing is defined }}{{ missing|length }}{{ missing|list }}{% for x in missing %}x{% endfor %}{{ missing == missing }}{{ missing or 'fallback' }}{{ d.nokey }}|{{ d['nokey'] }}|{{ d.nokey is defined }}|{{ l[10] is defined }}|{{ 'a' in missing }})J", R"J({"d": {"k": 1}, "l": [1]})J", R"J([]False0[]Truefallback||False|False|False)J", nullptr},
    {"dict_literal", R"J({% set d = {'a': 1, 'b': {'c': [1, 2]}} %}{{ d.b.c[1] }}{{ d|length }}{{ {'x': 1}.x }})J", R"J({})J", R"J(221)J", nullptr},
    {"none_item", R"J({{ n.x is defined }}{{ n['x'] is defined }})J", R"J({"n": null})J", R"J(FalseFalse)J", nullptr},
    {"ints_and_bool_keys", R"J({{ 0x10 }} {{ 1_000 }} {{ 1.5 }} {{ x.0.1 }})J", R"J({"x": [[5, 6]]})J", R"J(16 1000 1.5 6)J", nullptr},
    {"raise", R"J({% if true %}{{ raise_exception('bad thing') }}{% endif %})J", R"J({})J", "", R"J(bad thing)J"},
    {"unsafe_append", R"J({% set l = [] %}{% set _ = l.append(1) %}{{ l }})J", R"J({})J", "", R"J(access to attribute 'append' of 'list' object is unsafe.)J"},
    {"unsafe_is_defined", R"J({% set l = [] %}{{ l.append is defined }})J", R"J({})J", R"J(False)J", nullptr},
    {"undefined_attr_error", R"J({{ missing.attr }})J", R"J({})J", "", R"J('missing' is undefined)J"},
    {"undefined_add_error", R"J({{ missing + 1 }})J", R"J({})J", "", R"J('missing' is undefined)J"},
    {"str_plus_int_error", R"J({{ 'a' + 1 }})J", R"J({})J", "", R"J(can only concatenate str (not "int") to str)J"},
    {"none_iter_error", R"J({% for x in n %}{% endfor %})J", R"J({"n": null})J", "", R"J('NoneType' object is not iterable)J"},
    {"unknown_filter_in_if_ok", R"J({% if false %}{{ x|nosuchfilter }}{% endif %}ok)J", R"J({})J", R"J(ok)J", nullptr},
    {"unknown_filter_in_if_reached", R"J({% if true %}{{ 'x'|nosuchfilter }}{% endif %}ok)J", R"J({})J", "", R"J(no filter named 'nosuchfilter')J"},
    {"condexpr_no_else", R"J([{{ 'a' if false }}])J", R"J({})J", R"J([])J", nullptr},
    {"multiline_tag", R"J({{
  'a'
  ~ 'b'
}}{%
 if true
%}c{% endif %})J", R"J({})J", R"J(abc)J", nullptr},
    {"loop_in_macro", R"J({% macro m(xs) %}{% for x in xs %}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}{% endmacro %}{{ m([1, 2, 3]) }})J", R"J({})J", R"J(1,2,3)J", nullptr},
    {"pipes_precedence", R"J({{ -1|abs }} {{ 'a' ~ 1|string }} {{ 1 + 2|string|length }} {{ [1,2]|length > 1 }} {{ not true|string }})J", R"J({})J", R"J(1 a1 2 True False)J", nullptr},
    {"in_loop_set_visible_next", R"J({% for i in [1, 2] %}[{{ x }}]{% set x = i %}{% endfor %}{{ x }})J", R"J({"x": 9})J", R"J([9][9]9)J", nullptr},
    {"unicode_case", R"J({{ s|upper }}|{{ s|lower }}|{{ s|capitalize }}|{{ s|title }}|{{ 'Привет ЁЖ'|lower }}|{{ 'αβγ'|upper }}|{{ '你好 world'|title }}|{{ 2.0 is even }}{{ 2.5 is even }}{{ 3.0 is odd }})J", R"J({"s": "héllo wÖrld ça"})J", R"J(HÉLLO WÖRLD ÇA|héllo wörld ça|Héllo wörld ça|Héllo Wörld Ça|привет ёж|ΑΒΓ|你好 World|TrueFalseTrue)J", nullptr},
};

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

TEST(ChatTemplateLanguage, MatchesJinja2) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    auto t = ChatTemplate::parse(c.source);
    ASSERT_TRUE(t.ok()) << t.error().message;
    auto out = t->render(json::parse(c.context));
    if (c.error) {
      ASSERT_FALSE(out.ok()) << "rendered: " << *out;
      EXPECT_NE(lower(out.error().message).find(lower(c.error)), std::string::npos) << out.error().message;
    } else {
      ASSERT_TRUE(out.ok()) << out.error().message;
      EXPECT_EQ(*out, c.expected);
    }
  }
}

Result<std::string> render(const char* source, const json& context = json::object()) {
  MOAT_ASSIGN_OR_RETURN(ChatTemplate t, ChatTemplate::parse(source));
  return t.render(context);
}

TEST(ChatTemplateLanguage, DictAccess) {
  json ctx = {{"d", {{"k", 1}, {"items", "shadow"}}}, {"m", {"p", "q"}}};
  auto out = render("{{ d.k }}{{ d['k'] }}{{ d.get('k') }}{{ d.get('zz') }}{{ d.get('zz', 'def') }}"
                    "{{ d.items()|list }}{{ d['items'] }}{{ d.items is callable }}{{ m.0 }}{{ m[1] }}",
                    ctx);
  ASSERT_TRUE(out.ok()) << out.error().message;
  EXPECT_EQ(*out, "111Nonedef[('k', 1), ('items', 'shadow')]shadowTruepq");
}

TEST(ChatTemplateLanguage, RaiseExceptionIsAnErrorWithItsMessageAndLine) {
  auto out = render("line one\n{% if messages|length == 0 %}\n{{ raise_exception('No messages given.') }}\n{% endif %}",
                    json{{"messages", json::array()}});
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.error().message.find("No messages given."), std::string::npos) << out.error().message;
  EXPECT_NE(out.error().message.find("line 3"), std::string::npos) << out.error().message;
}

TEST(ChatTemplateLanguage, UnclosedBlockNamesLineAndExpectedTag) {
  auto t = ChatTemplate::parse("a\n{% for m in messages %}\n{% if m %}x{% endif %}\n");
  ASSERT_FALSE(t.ok());
  const std::string& msg = t.error().message;
  EXPECT_NE(msg.find("'endfor'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("line 2"), std::string::npos) << msg;  // where the for was opened
}

TEST(ChatTemplateLanguage, MismatchedEndTag) {
  auto t = ChatTemplate::parse("{% for m in x %}\n{% endif %}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("line 2"), std::string::npos) << t.error().message;
  EXPECT_NE(t.error().message.find("'endfor'"), std::string::npos) << t.error().message;
}

TEST(ChatTemplateLanguage, UnknownFilterIsASyntaxErrorWithLine) {
  auto t = ChatTemplate::parse("ok\n\n{{ x | frobnicate }}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("line 3"), std::string::npos) << t.error().message;
  EXPECT_NE(t.error().message.find("unknown filter 'frobnicate'"), std::string::npos) << t.error().message;
  auto test = ChatTemplate::parse("{{ x is frobnicated }}");
  ASSERT_FALSE(test.ok());
  EXPECT_NE(test.error().message.find("unknown test 'frobnicated'"), std::string::npos);
}

TEST(ChatTemplateLanguage, SyntaxErrors) {
  for (const char* bad : {"{{ 1 + }}", "{% if %}{% endif %}", "{{ 'unterminated }}", "{% set %}",
                          "{{ x", "{# open comment", "{% break %}", "{% frobnicate %}", "{{ (1, 2 }}",
                          "{% macro m( %}{% endmacro %}"}) {
    auto t = ChatTemplate::parse(bad);
    EXPECT_FALSE(t.ok()) << bad;
    if (!t.ok()) {
      EXPECT_NE(t.error().message.find("line 1"), std::string::npos) << t.error().message;
    }
  }
}

TEST(ChatTemplateLanguage, RuntimeErrorNamesLine) {
  auto out = render("a\nb\n{{ 1 // 0 }}");
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.error().message.find("line 3"), std::string::npos) << out.error().message;
}

TEST(ChatTemplateLanguage, FromJsonExtension) {
  // Not in jinja2; DeepSeek V3.2 applies it to string tool arguments.
  auto out = render("{% for k, v in ('{\"b\": 1, \"a\": [true]}'|from_json).items() %}{{ k }}={{ v|tojson }};{% endfor %}");
  ASSERT_TRUE(out.ok()) << out.error().message;
  EXPECT_EQ(*out, "b=1;a=[true];");
}

TEST(ChatTemplateLanguage, ContextKeepsKeyOrderForTojson) {
  json args = json::parse(R"({"zeta": 1, "alpha": {"y": 2, "x": "é"}})");
  auto out = render("{{ args|tojson }}", json{{"args", args}});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, R"({"zeta": 1, "alpha": {"y": 2, "x": "é"}})");
}

TEST(ChatTemplateLanguage, TemplateIsReusable) {
  auto t = ChatTemplate::parse("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}");
  ASSERT_TRUE(t.ok());
  ChatTemplate copy = *t;
  for (int n : {0, 3, 1}) {
    json msgs = json::array();
    for (int k = 0; k < n; ++k) msgs.push_back(k);
    auto out = copy.render(json{{"messages", msgs}});
    ASSERT_TRUE(out.ok());
    EXPECT_EQ(*out, std::to_string(n));
  }
}

}  // namespace
}  // namespace moat
