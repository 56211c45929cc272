// Unit tests for grammar_hazard(): reversed repetition ranges are refused; braces inside
// literals, classes and comments, and valid ranges, are left to llama.cpp's parser.
#include "check.h"
#include "grammar_guard.h"

using trioserve::grammar_hazard;

int main() {
    CHECK(!grammar_hazard("root ::= \"a\"{5,2}").empty());
    CHECK(!grammar_hazard("root ::= x\nx ::= [a-z]{ 3 , 1 }").empty());
    CHECK(grammar_hazard("root ::= \"a\"{5,2}").find("{5,2}") != std::string::npos);
    CHECK(grammar_hazard("root ::= \"yes\" | \"no\"").empty());
    CHECK(grammar_hazard("root ::= \"a\"{2,5} \"b\"{3} \"c\"{1,} \"d\"{,4}").empty());
    CHECK(grammar_hazard("root ::= \"{5,2}\" [{}] # {5,2}\n").empty());    // not quantifiers
    CHECK(grammar_hazard("root ::= \"\\\"{5,2}\"").empty());               // escaped quote inside
    CHECK(grammar_hazard("root ::= [\\]{5,2}]").empty());                      // escaped ] inside a class
    CHECK(grammar_hazard("root ::= \"a\"{99999999999999999999,1}").size() > 0);  // saturates, still reversed
    CHECK(grammar_hazard("root ::= (").empty());                               // the parser rejects it
    CHECK(grammar_hazard("").empty());
    return trioserve_test::finish("test_grammar_guard");
}
